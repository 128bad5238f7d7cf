"""The layout lab: measure and predict memory, communication and step time of layouts."""
