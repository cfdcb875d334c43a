"""The networks, gpt-fast style: nothing but torch."""
