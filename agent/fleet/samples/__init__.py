"""The controller's samples for retraining: the bounded store and its export as a dataset."""
