"""Limits of docs/wire-format.md section 7 that more than one side enforces: the server
refuses a request past them before any work, and a replay worker refuses it too."""

MAX_REPLAY_TOKENS = 8192  # R: far past any useful one, a bound on what one replay may cost
