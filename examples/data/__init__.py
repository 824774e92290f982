"""Datasets of the examples: real data that needs no download (digits, stdlib source), and CIFAR-10."""
