"""``python -m jaxpar``: the ``jaxpar`` command (:func:`jaxpar.cli.console`, which installs
the start-up signal handlers before it imports JAX)."""

from jaxpar.cli import console

if __name__ == "__main__":
    console()
