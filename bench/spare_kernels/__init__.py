"""Triton kernels no backend uses: a row-wise LayerNorm and the q/k/v projections in one launch.

They were written for region bodies that did not keep them (torch's ops measured as fast); the bench
keeps them for its per-kernel table, the host-time rows and the kernel-targets lane, and
tests/kernels tests them against their references. Out of the wheel: the pack never imports bench/.
"""
