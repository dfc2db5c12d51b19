"""Runnable training jobs that use checkfreq (the demo's job lives here)."""
