"""Version probes and import shims: the only place that knows where optional
libraries keep their classes."""
