// Replaced by the message store.
