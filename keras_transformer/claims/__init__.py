"""Measurements of the paper's claims: Table 1 and the design notes."""
