"""Route health injection: the carrier's health decides what ExaBGP announces to that carrier."""
