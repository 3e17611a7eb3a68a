"""The composition root: builds the components, wires each slot's frame path, reports the device."""
