"""Stage worker service: one pipeline stage of one virtual worker on one device."""
