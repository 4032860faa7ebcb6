"""The training step the user describes (TrainStep), its optimizer and the host RNG it draws from."""
