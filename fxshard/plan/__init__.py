"""Plans: styles, decorators, FQN-glob plans, shipped Hugging Face plans, automatic pairing."""
