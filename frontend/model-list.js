// The served models (GET /v1/models): loaded once, again when the key or the list changes.

import { AuthError, fetchModels } from "./models.js";

export class ModelList {
  /**
   * `apiKey()`: the key to ask with; `shown()`: the list is there (`this.models`);
   * `failed(err, quiet, refused)`: it could not be loaded (`refused`: an AuthError, the key is refused).
   */
  constructor(apiKey, shown, failed) {
    this.apiKey = apiKey;
    this.shown = shown;
    this.failed = failed;
    this.models = null; // [{id, contextLength, parent}], once loaded
    this.loading = null; // the request under way: the start and the hello share it
  }

  /** Forget the list (another key, or a model gone): the next `load` asks again. */
  reset() {
    this.models = null;
  }

  load(quiet = false) {
    if (this.models) {
      this.shown();
      return Promise.resolve();
    }
    this.loading ??= this.fetch(quiet).finally(() => (this.loading = null));
    return this.loading;
  }

  async fetch(quiet) {
    try {
      this.models = await fetchModels(this.apiKey());
    } catch (err) {
      this.failed(err, quiet, err instanceof AuthError);
      return;
    }
    this.shown();
  }
}
