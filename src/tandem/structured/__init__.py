"""Structured output: grammars that constrain what a request may generate (JSON schema, regex, EBNF),
their per-request matchers, and tool calls built on them."""
