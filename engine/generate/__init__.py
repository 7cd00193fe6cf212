"""Generate requests (one KSampler run): the typed request the client validates and sends, and the rank-side run."""
