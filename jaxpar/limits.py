"""Bounds beyond any run: a larger number is a typo, refused in one line where it is read
(the config's fields and the command line's options share them; this module imports
nothing, so the command line parses without loading JAX)."""

#: The most devices a setting may name (``run.devices``, a mesh degree): 2**20 =
#: 1,048,576, beyond any machine built.
MAX_DEVICES = 2**20
#: The most simulated CPU devices a run without an accelerator gets. Each costs XLA host
#: memory and start-up time that grows faster than their number (1,024 start in 0.7 s;
#: 4,096 in 8 s and 0.6 GB on one laptop core; 2**31 took 23.7 GB before the kernel killed
#: the process), and every step is compiled for all of them — while 4,096 still plans a
#: large cluster (``jaxpar plan --devices 4096``). An accelerator has no such cap: there a
#: count is checked against the devices that exist.
MAX_CPU_DEVICES = 4096
#: The most devices ``jaxpar plan`` compiles layouts for on simulated CPU devices; above it
#: each layout is estimated from the model's shape (:mod:`jaxpar.lab.analytic`): 64 devices'
#: programs compile in seconds each here, 1,024 devices' in minutes.
COMPILED_DEVICES = 64
#: Steps (and step intervals): a trillion.
MAX_STEPS = 10**12
#: A global batch: 2**31 examples.
MAX_BATCH = 2**31
