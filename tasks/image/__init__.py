"""Image classification tasks (Fashion-MNIST)."""
