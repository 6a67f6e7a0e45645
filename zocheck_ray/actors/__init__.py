"""The trainer and the shadow: Ray-free classes and their Ray actors (`ray_actors`)."""
