"""The compile lifecycle of the regions: precompiled variants (``precompiled``, ``variants``), the
compile thread (``background``), what compiles after warmup (``recompiles``) and the ledger that
counts a model's compiles (``ledger``)."""
