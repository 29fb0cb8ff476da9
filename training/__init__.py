"""Trainers for the project's drafts: offline, resumable, outside the runtime package ``mtad``."""
