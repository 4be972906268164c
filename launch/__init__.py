"""The command-line entry points (``python -m launch.<command>``).

Importing the package runs JAX on the CPU when ``JAX_PLATFORMS`` is unset and the machine has no TPU
or GPU (``_common.cpu_unless_accelerator``): the commands then start without libtpu's TPU probe lines.
"""

from launch._common import cpu_unless_accelerator

cpu_unless_accelerator()
