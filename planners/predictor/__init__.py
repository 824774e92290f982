"""QSync's predictor: the op graph of a training step, its memory, modeled device costs, and the
replay that predicts a plan's synchronous step time and peak memory."""
