"""Graph / module rewrites: each module is one pattern, one replacement and
one check, and counts how often it fired so tests can prove it."""
