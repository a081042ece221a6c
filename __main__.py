"""``python -m unet_compiler bench [options]``: an alias of ``python -m unet_compiler.bench run``
(bench/__main__.py, the bench's command line); its other commands (compat, starts, soak, kernels,
targets) are forwarded by their names. The bench is development tooling: it is in a checkout of the
repository (``bin/bench``), not in the installed wheel, where this says so."""
import sys

if __name__ == "__main__":
    try:
        from .bench.__main__ import main
    except ImportError as e:
        if "bench" not in str(e):
            raise
        sys.exit("unet_compiler: the bench is not installed with the pack; it runs from a checkout of the "
                 "repository: git clone https://github.com/unet-compiler/unet-compiler && cd unet-compiler "
                 "&& bin/bench")
    argv = sys.argv[1:]
    sys.exit(main(["run", *argv[1:]] if argv[:1] == ["bench"] else argv))
