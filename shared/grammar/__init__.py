"""Structured output: grammars (llguidance) that constrain every node of a draft tree."""
