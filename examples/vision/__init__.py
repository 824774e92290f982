"""Image classification example: ResNet / VGG on digits, ResNet on CIFAR-10."""
