"""The Ray-free trainer and shadow: the training loop, the shadow's pipeline, the messages between them."""
