// Runs before first paint (a classic script in <head>) so a stored theme never flashes.
(function () {
  try {
    var s = JSON.parse(localStorage.getItem("wsllm.v1.settings") || "{}");
    if (s && (s.theme === "light" || s.theme === "dark")) document.documentElement.dataset.theme = s.theme;
  } catch (e) {
    /* no storage: follow the system theme */
  }
})();
