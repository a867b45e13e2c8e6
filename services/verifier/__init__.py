"""The verifier service: the target model, its paged KV, one packed forward per micro-batch."""
