"""``python -m unet_compiler bench [options]``: an alias of ``python -m unet_compiler.bench run``
(bench/__main__.py, the bench's command line); its other commands (compat, starts, soak, kernels,
targets) are forwarded by their names."""
import sys

from .bench.__main__ import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    sys.exit(main(["run", *argv[1:]] if argv[:1] == ["bench"] else argv))
