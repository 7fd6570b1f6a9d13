"""The texts spoken in the held-out long-form files (`scripts/make_longform_fixtures.py --set heldout`).

The same structures as `scripts/longform_texts.py` with other stories, for files nothing was tuned on. Every
sentence here was written for this project and is dedicated to the public domain (CC0). Like the fixtures' texts
they avoid words that English spells two ways (British and American), numbers in any form, names, abbreviations,
contractions, possessives and hyphens, so that a reference word and Whisper's spelling of it agree after the
English normaliser and a word error is a real one.
"""

from __future__ import annotations

# (a) dense speech, many voices, packed into full 30 s windows: short and medium sentences
DENSE = [
    "The village lay high in the mountains, above the dark pine forests.",
    "Its houses were built of timber, with steep roofs and small windows.",
    "Goats grazed on the slopes, and bells rang from their necks all day.",
    "In the long winters nobody came up from the valley below.",
    "The only way to reach the town was a steep and narrow path.",
    "A mule carried salt, oil and medicine up that path every month.",
    "The villagers made cheese, and they carried it down on their backs.",
    "They sold it in the town and came home late at night, tired and cold.",
    "Late in the summer a group of surveyors arrived with tripods and chains.",
    "They marked the slopes with stakes and little flags.",
    "The children followed them everywhere and asked endless questions.",
    "The surveyors said that a railway would climb the mountain soon.",
    "Most of the villagers laughed, because the slopes were far too steep.",
    "But the next spring the workers came, with drills, shovels and dynamite.",
    "They cut a ledge along the ridge and blasted tunnels through the mountain.",
    "The noise of the explosions echoed between the mountains.",
    "The workers lived in canvas tents beside the stream.",
    "They bought milk and cheese from the villagers and paid them well.",
    "In the evenings they sang songs from their own distant homes.",
    "Some of the young people in the village joined the work.",
    "They learned to lay the heavy sleepers and to bolt the rails together.",
    "It took many years before the line reached the edge of the village.",
    "A small station was built near the chapel, with a bench and a bell.",
    "Everybody in the village gathered on the platform to greet the train.",
    "It came slowly around the last bend, puffing smoke and steam.",
    "The goats ran away in fright, and the children cheered.",
    "An old shepherd said he had never seen anything so ugly.",
    "Yet he was among the passengers on the very next journey.",
    "After that, the valley seemed much closer than before.",
    "Doctors and nurses could now reach the village before noon.",
    "The cheese went down the mountain in crates, packed with straw.",
    "Visitors came up in the summer to walk in the high meadows.",
    "Families offered their spare beds to the visitors.",
    "Then, in a winter of heavy snow, an avalanche buried the line.",
    "The evening train was trapped in a tunnel below the village.",
    "Its passengers sat in the dark, listening to the wind outside.",
    "The villagers did not wait for help from the valley.",
    "They took their shovels and dug through the snow all night.",
    "Women carried warm milk and blankets along the buried rails.",
    "Before dawn they broke through to the mouth of the tunnel.",
    "The passengers came out stiff and hungry, but nobody was hurt.",
    "The driver of the train shook every hand he could find.",
    "Since then, the railway company has sent a gift every winter.",
    "It usually arrives in the depths of winter, a crate of warm coats and boots.",
    "The children still run to the platform when they hear the whistle.",
    "And the old shepherd still talks about that night to anyone who will listen.",
]

# (b) a dialogue of two speakers, alternating (speaker A says the even lines, B the odd ones)
DIALOGUE = [
    "Are you going down to the market on Saturday morning?",
    "I was thinking about it, if it does not rain.",
    "We could share a taxi and save a little money.",
    "That sounds sensible, my bags get heavy on the way home.",
    "What do you need to buy this time?",
    "Butter, cheese, honey, and something nice for my nephew.",
    "The honey stall was empty last time, do you remember?",
    "Yes, we arrived much too late in the afternoon.",
    "Then we should leave early, before the crowds arrive.",
    "But the taxi costs more before breakfast, you know.",
    "Then I will pay for it, and you can bring breakfast.",
    "I will bake those almond buns that you like so much.",
    "Lovely, and I will bring a flask of coffee.",
    "And we must not forget the bags for the vegetables.",
    "My husband asked me to find him a warm scarf.",
    "There is a woman who knits hats and gloves near the fountain.",
    "Her gloves are lovely, but they are very expensive.",
    "You can usually bargain with her if you smile.",
    "Last time I smiled and she raised the price.",
    "Perhaps you did not smile warmly enough.",
    "What time should I knock on your door, then?",
    "Come as soon as you see my curtains open.",
    "And if you oversleep, I will ring the bell until you wake up.",
    "Please do not, the dog will bark and wake everybody in the street.",
    "Then I will tap on the window very quietly.",
    "Good, and I will be waiting at the door with my basket.",
]

# (c) a memoir whose last sentence is cut: only LAST_SPOKEN of LAST_SENTENCE is in the audio
GARDEN = [
    "My uncle kept an orchard on the slope behind his cottage.",
    "Plum trees grew along the top, where the earth was thin.",
    "Cherries filled the middle, and walnuts shaded the bottom near the brook.",
    "Every tree had its own character, and he spoke to them like old friends.",
    "In the late winter he pruned the branches with a small curved saw.",
    "I gathered the cuttings and tied them into bundles for the fire.",
    "He paid me with hot chocolate and old songs from his childhood.",
    "When the blossom came, the slope turned white and pink overnight.",
    "Bees arrived from the hives on the far side of the valley.",
    "My uncle sat among the trees and listened to them working.",
    "He said that a quiet orchard in spring was a bad sign.",
    "A late frost could ruin the flowers in the space of a night.",
    "On cold evenings we lit small fires between the rows to warm the air.",
    "We stayed awake until dawn, feeding the flames with dry branches.",
    "By summer the cherries were dark and shining on every branch.",
    "Starlings came for them in noisy flocks from every hedge around.",
    "We hung strips of shiny foil and old spoons to frighten them away.",
    "It worked for about a week, and then the birds stopped caring.",
    "Picking the cherries took every hand in the family.",
    "I climbed the ladders, and my cousins held them steady below.",
    "We ate almost as many as we put into the baskets.",
    "The plums ripened later, heavy and purple, in the warm weeks of August.",
    "Wasps found the fallen plums and made the grass dangerous to walk on.",
    "My uncle turned the plums into a thick syrup and a strong, sweet brandy.",
    "He kept the brandy for weddings, funerals and very cold nights.",
    "In the autumn we knocked the walnuts down with long poles.",
    "My hands were stained brown for weeks from the green husks.",
    "He dried the nuts on racks in the attic of the cottage.",
    "Through the winter, their rich aroma filled every room of the cottage.",
    "When his knees grew stiff, he could no longer climb the ladders.",
    "So he stood at the bottom and told us which branches to reach for.",
    "He said that trees remember every kindness and every careless cut.",
    "It took me many years to understand what he meant by that.",
    "Now I prune my own small orchard with his curved saw.",
    "My niece gathers the cuttings and ties them into bundles for the fire.",
]
LAST_SENTENCE = ("Yesterday she asked me why I speak so softly to the trees, and I described my uncle and the "
                 "orchard on the slope behind his cottage.")
LAST_SPOKEN = "Yesterday she asked me why I speak so softly to the trees"  # the audio is cut at the comma's pause

# (d) one speaker, speed varied per sentence, a few long sentences
BRIDGES = [
    "Welcome, everybody, and I am glad to see so many faces on such a wet afternoon.",
    "My subject today is the mill, and the rivers that turned its wheels for longer than anyone can remember.",
    "Long before coal or electricity, moving water was the strongest helper that people had.",
    "A village without a mill had to grind its grain by hand, which was slow and tiring work that usually fell "
    "to the women and the children.",
    "The idea of the mill is simple.",
    "The river pushes against a wheel, the wheel turns a shaft, and the shaft turns a heavy slab of granite that "
    "crushes the grain into flour.",
    "Millers learned to dig a channel that took water away from the river and poured it over the wheel from "
    "above.",
    "A wheel fed from above is far more powerful, because the weight of the falling water does the work as well "
    "as its speed.",
    "Where the river was slow, people built dams, and behind each dam a quiet pond filled up and stored the "
    "power for the dry months.",
    "Those ponds became homes for fish, frogs and herons.",
    "Mills did not only grind grain.",
    "They sawed timber, beat wool into cloth, and crushed olives for oil.",
    "Later, entire towns grew up around rows of mills along a fast river, and the workers who lived there spent "
    "their days among the roaring wheels and the endless clatter of looms.",
    "The work was hard and the hours were long.",
    "Young children worked beside their parents, and many of them never learned to read.",
    "The rivers suffered as well as the people.",
    "Chemicals and waste from the factories turned the water strange shades of orange and purple, and the fish "
    "disappeared from many streams for generations.",
    "Then steam power arrived, and the mills no longer needed the river at all.",
    "Most of them closed, and their wheels rusted or rotted where they stood.",
    "In recent years, some villages have brought their old mills back to life.",
    "Volunteers clear the channels, mend the wheels, and sell the flour at local markets.",
    "If you ever have the chance, I would urge you to stand beside a working mill on a cold morning, to feel the "
    "floor tremble under your feet, to listen to the water and the grinding wheels, and to taste porridge made "
    "from grain that the river itself has ground.",
    "It is a very old kind of music.",
    "Thank you for your attention, and there is warm cake and coffee for everybody in the next room.",
]

# short clips whose first word is a weak syllable
WEAK_ONSETS = [
    "A tall ladder was resting against the trunk of the oak.",
    "The kettle began to whistle just as the guests arrived.",
    "In the evening little candles were lit along the canal.",
    "An owl called softly from the edge of the forest.",
    "Of all the seasons, she loved the autumn most of all.",
    "At the top of the tower a flag was flapping in the wind.",
    "As the music faded, the dancers slowly left the floor.",
    "To make good pickles you need strong vinegar and a heavy pot.",
]
