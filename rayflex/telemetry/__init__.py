"""What a run leaves behind: typed events, goodput, metrics export, report, status rows."""
