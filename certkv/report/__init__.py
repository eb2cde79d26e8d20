"""Presentation: what a certificate means in words, figures and one self-contained HTML page."""
