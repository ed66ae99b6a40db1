"""Repository tools, not installed: run each as a script (`python tools/<name>.py`); tests
import them as `tools.<name>`."""
