"""Training: the Trainer, its loop, its resume and requeue, and the state a fit restores."""
