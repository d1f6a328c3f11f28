"""Phase 1: the target's hidden states extracted into a cache: the job, its ranks' pipeline, the dry
run, and `regenerate` (a chat dataset's replies made by the target)."""
