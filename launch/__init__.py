"""The command-line entry points (``python -m launch.<command>``).

Importing the package runs JAX on the CPU when ``JAX_PLATFORMS`` is unset and the machine has no TPU
or GPU (``_common.cpu_unless_accelerator``): the commands then start without libtpu's TPU probe lines;
and it turns tqdm's bars off when stderr is not a terminal (``_common.no_bars_off_terminal``), so a
log file holds lines, not ``\\r`` frames.
"""

from launch._common import cpu_unless_accelerator, no_bars_off_terminal

cpu_unless_accelerator()
no_bars_off_terminal()
