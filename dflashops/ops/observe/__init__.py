"""What the controller sees and says: observation of statuses, notifications and their courier, watch, plots."""
