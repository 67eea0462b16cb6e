"""Speculative decoding: cheap drafts of the next tokens, verified by the target model in the normal
step (one forward scores the last token and the k drafts), accepted while they equal what the target
samples at each position."""
