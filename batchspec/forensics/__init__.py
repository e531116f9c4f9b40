"""Evidence that a run is correct: invariant checks, equivalence audits, corruption detectors."""
