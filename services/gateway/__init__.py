"""The gateway service: OpenAI-compatible HTTP API over the Redis-streams bus."""
