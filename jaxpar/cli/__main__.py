"""``python -m jaxpar.cli``: the ``jaxpar`` command."""

from jaxpar.cli import console

if __name__ == "__main__":
    console()
