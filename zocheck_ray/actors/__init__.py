"""The Ray shells: the trainer's and the shadow's actors, their names, and the transport between them."""
