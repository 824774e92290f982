"""QSync's cost profiler: op × leg × precision costs measured on the local device."""
