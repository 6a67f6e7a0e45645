"""State images in host memory, and the platform's speed-ups: each probed, each with a plain fallback."""
