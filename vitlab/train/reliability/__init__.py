"""What keeps a run safe: last.ckpt and termination signals, exact resume, the signal watchdog, atomic
checkpoint IO, the non-finite and run-folder guards, credential redaction, and the Lightning internals
these rely on. Imports nothing from `run` or `objectives`."""
