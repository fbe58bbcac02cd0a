"""Image classification models (Fashion-MNIST)."""
