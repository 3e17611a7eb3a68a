"""The fleet as its devices report it: the controller's live view, ``fleet status`` and ``fleet watch``."""
