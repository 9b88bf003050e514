"""The bridge's state words and bulk runs: C where built (_runs), with Python references."""
