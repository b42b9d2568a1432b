"""Report: the one place where evidence records become sentences and JSON."""
