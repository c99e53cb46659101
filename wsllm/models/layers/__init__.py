"""The shared layers every family assembles (norms, attention, the dense MLP, the mixture of
experts, the decoder layer): each reads its knobs from ModelConfig once, when it is built."""
