"""Short everyday chat questions, written for Augury's benchmarks (not taken from any dataset,
and not used to distill the drafts): what most chat users send."""

EVERYDAY_QUESTIONS = (
    "What is a good way to start learning to cook?",
    "How do I keep my houseplants alive in winter?",
    "Can you suggest a name for a grey cat?",
    "What should I pack for a weekend trip to the mountains?",
    "How long should I boil an egg for a soft yolk?",
    "Why is the sky blue?",
    "Give me three ideas for a rainy Sunday afternoon.",
    "How can I fall asleep faster?",
    "What is the difference between a virus and a bacterium?",
    "Write a short thank-you note to a neighbour who watered my garden.",
    "How do I politely decline a meeting invitation?",
    "What are some easy exercises I can do at my desk?",
    "How often should I water a cactus?",
    "Explain what inflation is in simple words.",
    "What is a healthy breakfast I can make in five minutes?",
    "How do I remove a coffee stain from a white shirt?",
)
