"""How insight-queue is served and deployed, and the triggers the app calls."""
