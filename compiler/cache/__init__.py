"""The pack's persistent compile cache: one entry per model and setup (``entry.py``: the precompiled
region variants and torch's Mega-Cache), its key (``key.py``), torch's own caches moved beside it
(``torch_dirs.py``), inductor's CPU ISA probe record (``cpu_isa.py``) and atomic writes
(``files.py``). Users of the cache hold a :class:`CompileCache`."""
from . import cpu_isa, megacache  # noqa: F401 - the submodules tests and faults reach through here
from .entry import DIR_ENV, MODE_ENV, CompileCache, directory, mode, pack_entry, unpack_entry  # noqa: F401
from .key import FORMAT, code_digest, key_facts, key_of  # noqa: F401
